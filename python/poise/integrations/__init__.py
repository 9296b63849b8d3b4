"""Poise inside other frameworks. ``poise.integrations.transformers``: "poise" as a Hugging Face
transformers experts implementation (imported on demand: ``import poise`` never imports transformers)."""
