"""MXFP8 quantization (OCP MX: 32-element blocks, E8M0 scale) and the fused SwiGLU-OAI + MXFP8 kernel."""
