"""Meshes, shardings, the train state and the jitted synchronous-SGD step."""
