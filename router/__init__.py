"""kvgate's HTTP gateway: app, proxy, configuration and CLI."""
