"""`pagoda epp`: Pagoda's router as a Gateway API Inference Extension endpoint picker."""
