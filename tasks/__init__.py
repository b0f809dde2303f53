"""The stages of a round, one module each: pure stage bodies plus thin Prefect tasks."""
