"""`python -m serve.rollout`: start the rollout server (serve/server.py) with the flags of serve/config.py."""

import tyro

from serve import server
from serve.config import ServerConfig

if __name__ == "__main__":
    server.main(tyro.cli(ServerConfig, description=server.__doc__))
