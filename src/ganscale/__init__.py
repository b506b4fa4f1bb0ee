"""ganscale: GAN training on one process or many, with the same config and the same result."""

__version__ = "0.1.0"
