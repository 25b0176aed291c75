// containerd and its runc shim share one global plugin registry in this program, which each of them would
// load whole: the shim every daemon plugin (and fail on the first that wants the daemon's configuration),
// the daemon the shim's task service. Each keeps what its own binary registers, and nothing else.
package main

import (
	"expvar"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/containerd/containerd/v2/plugins"
	"github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"
)

// shimTaskPlugin is the runc shim's task service: the only plugin the daemon's binary does not register.
const shimTaskPlugin = "io.containerd.ttrpc.v1.task"

// shimPlugins are the plugins containerd-shim-runc-v2's own binary registers (its task service, and from
// its tracing build the otlp exporter, tracing, ttrpc tracing, pprof, and the deprecation warnings).
var shimPlugins = map[string]bool{
	shimTaskPlugin:                            true,
	"io.containerd.warning.v1.deprecations":   true,
	"io.containerd.tracing.processor.v1.otlp": true,
	"io.containerd.internal.v1.tracing":       true,
	"io.containerd.ttrpc.v1.otelttrpc":        true,
	"io.containerd.http.v1.pprof":             true,
}

// keepPlugins leaves in the registry only the plugins `keep` accepts, in the order they load.
func keepPlugins(keep func(uri string) bool) {
	kept := registry.Graph(func(r *plugin.Registration) bool { return !keep(r.URI()) })
	registry.Reset()
	for i := range kept {
		registry.Register(&kept[i])
	}
}

func daemonPlugins() {
	keepPlugins(func(uri string) bool { return uri != shimTaskPlugin })
}

// runcShimPlugins registers the shim's pprof handler, which its binary takes from containerd's internal
// pprof package (internal, so copied here), and drops the daemon's plugins.
func runcShimPlugins() {
	registry.Register(&plugin.Registration{
		ID:   "pprof",
		Type: plugins.HTTPHandler,
		InitFn: func(*plugin.InitContext) (interface{}, error) {
			m := http.NewServeMux()
			m.Handle("/debug/vars", expvar.Handler())
			m.Handle("/debug/pprof/", http.HandlerFunc(pprof.Index))
			m.Handle("/debug/pprof/cmdline", http.HandlerFunc(pprof.Cmdline))
			m.Handle("/debug/pprof/profile", http.HandlerFunc(pprof.Profile))
			m.Handle("/debug/pprof/symbol", http.HandlerFunc(pprof.Symbol))
			m.Handle("/debug/pprof/trace", http.HandlerFunc(pprof.Trace))
			return &http.Server{Handler: m, ReadHeaderTimeout: 5 * time.Minute}, nil
		},
	})
	keepPlugins(func(uri string) bool { return shimPlugins[uri] })
}
