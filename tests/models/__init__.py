"""Tests of mm3_compile/models/: config, checkpoints, the model vs its reference, CUDA graphs, TP."""
