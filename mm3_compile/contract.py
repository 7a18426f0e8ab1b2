"""Constants of the kernel contracts, the bottom layer every other module imports.

Kernels, ops, models and bench take these from here; nothing redefines them. FP8 dtypes and FP8
maxima are not here: they are decided per device by :mod:`mm3_compile.platform`.
"""

PAGE_SIZE = 128  # tokens per KV page; also the sparse block size of the indexer and the attention lists
MX_BLOCK_SIZE = 32  # elements per MX scale block (OCP MX v1.0)
E8M0_BIAS = 127  # an E8M0 scale byte b encodes 2^(b - 127); 255 is NaN
E8M0_MAX_FINITE = 254  # largest scale byte a quantizer emits
LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * LOG2E)

# how K/V dequant scales are given to the cache writer and the attention kernels
SCALE_NONE, SCALE_SCALAR, SCALE_PER_TOKEN_HEAD = 0, 1, 2
