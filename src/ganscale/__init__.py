"""ganscale: GAN training on one process or many, with the same config and the same result."""

__version__ = "0.1.0"
__all__ = ["train"]


def __getattr__(name: str):
    """`ganscale.train` (api.py), imported on first use: `import ganscale` stays cheap (no torch)."""
    if name == "train":
        from ganscale.api import train

        return train
    raise AttributeError(f"module 'ganscale' has no attribute {name!r}")
