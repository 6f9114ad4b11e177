"""Token data for a causal language model, as a pipeline copies it unchanged: a corpus prepared
into one packed token file per split, read in place by training, in an order that is O(batch).

    info = tokens.corpus.prepare(dataset, data_dir, tokenizer=..., seq_len=..., download_dir=...,
                                 named_corpora={...}, named_tokenizers={...})
    info = tokens.corpus.inspect_dataset(data_dir, prepare_command="my-lm prepare")
    blocks = tokens.corpus.split_blocks(data_dir, "train", info)    # a TokenBlocks
    rows = tokens.order.global_batch_indices(step, global_batch, len(blocks), seed)

Modules (one concern each; import them by name, nothing is imported with the package):
`corpus` (sources → documents in shards → a tokenizer → tokens in Ray tasks → packed splits;
`inspect_dataset`, `split_blocks`), `file` (the headered token file: `TokenFileWriter`,
`TokenBlocks` read by index in place or by ranged reads on object storage, `ReadAhead`), `packing`
(pre-tokenised Parquet rows → blocks), `order` (a keyed permutation per pass: a step's rows without
drawing the pass's whole order).
"""
