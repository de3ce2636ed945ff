"""What a loader's batches are: its settings checked once (options), the files' plan
(planner), the samplers (sampler, sources), finite passes, checkpoints and resharding."""
