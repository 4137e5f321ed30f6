"""Expert parallel: MoE token dispatch / combine by variable-size all-to-all."""
