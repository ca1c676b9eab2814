"""The models every task builds on the shared pre-LN encoder (`encoder.Encoder`).

Each model's constructor lists its keywords (width, depth, heads, dropouts, ...) itself and hands them
to `Encoder` in a call of the same shape as its neighbours': those lists are each task's config
(`task.model.*`, what Hydra fills and `--help`/errors name), so they stay explicit per model rather than
hidden behind a shared options object; what the models share in *behaviour* lives once, in `encoder`,
`classifier` (heads, attention resolution) and `short_conv`.
"""
