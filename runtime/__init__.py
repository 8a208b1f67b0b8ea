"""Process launch, training loop, pipeline schedules and their executor, MoE all-to-all."""
