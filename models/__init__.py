"""Model zoo architectures; each file registers its variants with `efficient.zoo.register_model`."""
