"""Helpers shared by the test modules (test modules never import from each other)."""
