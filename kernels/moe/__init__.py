"""MoE on MXFP8 weights: routing alignment, grouped GEMM with in-register dequantization, the one-expert linear."""
