"""Device kernels with torch fallbacks (the fallback is what the CPU runs, and the reference the kernels match)."""
