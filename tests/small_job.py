"""The small DLRM recipe the job tests run: overrides of the real entry point that train in seconds on 2 CPU cores."""

SMALL_DLRM = [
    "device=cpu",
    "data.num_tables=4",
    "data.num_embeddings=1000",
    "data.embedding_dim=32",
    "model.dense_arch_layer_sizes=[64,32]",
    "model.over_arch_layer_sizes=[64,32,1]",
    "data.batch_size=128",
    "train.progress_bar=false",
]
