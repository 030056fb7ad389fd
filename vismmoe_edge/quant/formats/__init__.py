"""Readers of the quantized checkpoints users download: each turns its tensors back into dense weights.

- fp8.py: Qwen's official FP8 (float8_e4m3fn weight + `weight_scale_inv` per 128x128 block).
- compressed_tensors.py: llm-compressor's pack-quantized W4A16 (symmetric and asymmetric).
- awq.py: AutoAWQ GEMM (interleaved nibble order).

`source.py` groups a checkpoint's tensors into logical weights with these.
"""
