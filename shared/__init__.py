"""Code every pagoda service uses: configuration, sampling parameters, logging, ZMQ helpers."""
