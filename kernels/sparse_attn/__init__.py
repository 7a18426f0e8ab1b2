"""Block-sparse GQA attention over the paged KV cache: prefill and split-K decode."""
