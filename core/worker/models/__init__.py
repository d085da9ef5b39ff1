"""Model architectures: each module wires plugserve.worker.layers into one family. The
core registers its own in plugserve.builtin_models, by reference, exactly as a
third-party package registers its models through `register_models`."""
