"""What a run reports besides scalars: previews (artifacts) and typed records."""
