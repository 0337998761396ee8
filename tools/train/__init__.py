"""Training the tiny test models on CPU (`moemesh init-model --train`)."""
