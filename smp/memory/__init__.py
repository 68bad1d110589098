"""The memory savers that work on one module's activations and parameters: activation
checkpointing, activation offloading and delayed parameter initialisation."""
