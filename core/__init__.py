"""Pure building blocks: pytrees, layers, MoE pieces, init, optimizers, transforms."""
