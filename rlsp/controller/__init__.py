"""Ray orchestration: resource pools (placement groups) and worker groups with dp/sp-aware dispatch."""
