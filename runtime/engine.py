class Engine: pass
