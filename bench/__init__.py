"""Side-by-side benchmarks of the mm3 ops against PyTorch, FlexAttention and SDPA (``python bench/run.py``)."""
