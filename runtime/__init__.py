"""The serving runtime: engine, scheduler, model runner, models, sampling."""
