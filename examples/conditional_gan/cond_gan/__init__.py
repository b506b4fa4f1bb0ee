"""A user-written class-conditional GAN for ganscale: G, D, data set and loss (see ../config.yaml)."""
