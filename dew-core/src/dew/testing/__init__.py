"""Test helpers shipped with dew-core: small real components and fresh-interpreter runners."""
