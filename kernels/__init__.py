"""Triton kernels, their launchers and the pure-PyTorch reference beside each (``naive.py``)."""
