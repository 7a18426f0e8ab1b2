"""Lightning indexer: per-query block scores over the index-K cache and top-k block selection."""
