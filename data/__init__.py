"""Records, manifests, digests, the artifact store, prompt sources and answer checks.

The bottom layer: nothing here imports torch, Prefect or MLflow.
"""
