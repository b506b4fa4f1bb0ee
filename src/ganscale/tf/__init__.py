"""The tensorflow engine (`train.engine: tensorflow`): ganscale's mlp and dcgan recipes as Keras models on
tf.distribute.MirroredStrategy, in one process, with the torch engine's semantics and run directory.

This package's own modules import TensorFlow; this file and `capabilities` do not, so the CLI can check a config
(and refuse it) without TensorFlow installed. Modules: capabilities (what the engine refuses), devices (replicas
and the strategy), models (Keras G and D), feed (global batches and noise cut per replica), step (one D or G
optimizer step across replicas), loop (training, run directory, checkpoints).
"""
