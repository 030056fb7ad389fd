"""Quantized routed experts: int4/int8 records on disk, torch's own kernels, and converters from what users download.

- packing.py: int4 nibble layouts (row-major, the CPU kernel's tiles, the CUDA kernel's input)
- quantize.py: int4 group-wise / int8 per-channel quantizers in the kernels' conventions
- config.py: our `quantization_config` (config.json) and its checked reader
- record.py: one expert's record (weights + scales + zeros back to back) and its encoder
- kernels.py: views over a record's bytes, CPU/CUDA compute, dequantization
- catalogue.py: one byte range per (layer, expert) of a quantized checkpoint
- formats/, source.py: FP8, compressed-tensors W4A16 and AWQ sources as dense weights
- convert.py, dequantize.py: a checkpoint to records and back (vismmoe_edge.conversion finds the model family)
See docs/quantization.md.
"""
