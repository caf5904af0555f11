"""Serving engine: requests, scheduler, model runner, sampler."""
