"""placeholder"""
from .runner import RankFailedError, run
