"""Paged KV-cache writes (K/V -> [num_blocks, Hkv, 128, 2D] pages, FP8 flavours from the authority)."""
