"""What a program costs: FLOPs per op, the one cost model of compute and communication, and
hardware profiles with their achieved-rate tables."""
