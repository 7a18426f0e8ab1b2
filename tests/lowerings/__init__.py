"""Tests of lowerings/: the ops inside torch.compile and torch.export, the fusion pass, the generated code."""
