"""Tensor parallelism: the workers' process group and the collectives the parallel layers
(layers/parallel_linear.py, layers/vocab_parallel_embedding.py) call."""
