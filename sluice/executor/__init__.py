"""Executors: between the engine core's loop and the workers that run the model."""
