"""The traces -> RL dataset stage, split by concept: `assemble` (vectorized episode reassembly
and checks) and `manifest` (config, Parquet schema, manifest). Entry point:
`pipelines.traces_to_dataset.build_dataset`."""
