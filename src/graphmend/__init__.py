"""graphmend: find and fix torch.compile graph breaks by rewriting source."""

__version__ = "0.1.0"
