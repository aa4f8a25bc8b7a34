"""Model zoo architectures; each file registers its variants as data: a `VARIANTS` table of
`efficient.zoo.Variant`s over a typed config, passed to `efficient.zoo.register_variants`."""
