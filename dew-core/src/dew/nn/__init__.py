"""Neural-network building blocks that name their parameters' logical axes."""

__path__ = __import__("pkgutil").extend_path(__path__, __name__)  # noqa: F821
