"""The worker side of a step: persistent batch, model runner, attention inputs."""
