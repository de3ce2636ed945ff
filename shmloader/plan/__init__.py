"""What a loader's batches are: its settings checked once (options), the fields'
declarations and plans (fields), the loader's plan (planner), the ring's default size
(defaults), the samplers (sampler, sources) behind one interface of stream geometry
(geometry), finite passes (passes) and their dealt tails (tail), checkpoints
(checkpoint), resharding (reshard) and field names (naming)."""
