"""Records from elsewhere: other engines' logs and exports (AIPerf, exllamav3, SGLang,
engine metrics) normalized into crossrt's record."""
