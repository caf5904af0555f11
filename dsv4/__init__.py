"""dsv4: a portable inference engine for DeepSeek-V4-Flash."""

__version__ = "0.1.0"
