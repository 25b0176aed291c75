// gpu-device-plugin: the kubelet device plugin that advertises a node's GPUs as `nvidia.com/gpu` and hands
// them to containers as CDI device names, which containerd resolves against the CDI spec on the node
// (device nodes, driver libraries, environment). It knows each GPU by its UUID (the device ID the kubelet
// sees) and its CDI name; the spec says what the device is, so a GPU is healthy while the spec names it and
// every device node the spec gives it is a character device on the host.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

type gpuDevice struct {
	id  string // the GPU's UUID: the device ID in the kubelet's allocation and in NVIDIA_VISIBLE_DEVICES
	cdi string // fully qualified CDI name, e.g. nvidia.com/gpu=0
}

type deviceFlags []gpuDevice

func (d *deviceFlags) String() string { return fmt.Sprint(*d) }

func (d *deviceFlags) Set(value string) error {
	id, name, ok := strings.Cut(value, "=")
	if !ok || id == "" {
		return fmt.Errorf("--device %q: want UUID=CDI-NAME, e.g. GPU-0f1e...=nvidia.com/gpu=0", value)
	}
	if _, _, _, err := parser.ParseQualifiedName(name); err != nil {
		return fmt.Errorf("--device %q: %q is not a CDI device name (vendor.com/class=name): %v", value, name, err)
	}
	for _, dev := range *d {
		if dev.id == id {
			return fmt.Errorf("--device %q: device ID %s given twice", value, id)
		}
	}
	*d = append(*d, gpuDevice{id: id, cdi: name})
	return nil
}

type stringsFlag []string

func (s *stringsFlag) String() string     { return strings.Join(*s, ",") }
func (s *stringsFlag) Set(v string) error { *s = append(*s, v); return nil }

type gpuPlugin struct {
	pluginapi.UnimplementedDevicePluginServer
	resource  string
	devices   []gpuDevice
	specDirs  []string
	pluginDir string
	socket    string
	replicas  int
	interval  time.Duration
	cache     *cdi.Cache
	reasons   map[string]string // why each device is unhealthy, "" when healthy: logged when it changes

	mu      sync.Mutex
	health  map[string]string
	changed chan struct{} // closed and replaced whenever health changes
}

func runDevicePlugin(args []string) int {
	fs := flag.NewFlagSet("gpu-device-plugin", flag.ContinueOnError)
	var devices deviceFlags
	var specDirs stringsFlag
	fs.Var(&devices, "device", "a GPU as UUID=CDI-NAME (e.g. GPU-0f1e...=nvidia.com/gpu=0); repeat for each GPU (default: the devices the CDI specs name by UUID)")
	fs.Var(&specDirs, "cdi-spec-dir", "a directory of CDI specs to check the devices against; repeatable (default /etc/cdi and /var/run/cdi)")
	resource := fs.String("resource", "nvidia.com/gpu", "the extended resource the GPUs are advertised as")
	pluginDir := fs.String("plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory (kubelet.sock)")
	socketName := fs.String("socket", "dsnap-gpu.sock", "this plugin's socket name in --plugin-dir")
	replicas := fs.Int("replicas", 1, "advertise each GPU this many times (time-slicing: IDs <UUID>::<i>, all the same GPU)")
	interval := fs.Duration("health-interval", 2*time.Second, "how often device health and the kubelet's socket are checked")
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "gpu-device-plugin: unexpected arguments %v\n", fs.Args())
		return 2
	}
	if *replicas < 1 {
		fmt.Fprintf(os.Stderr, "gpu-device-plugin: --replicas %d: each GPU must be advertised at least once\n", *replicas)
		return 2
	}
	if len(specDirs) == 0 {
		specDirs = cdi.DefaultSpecDirs
	}
	cache, _ := cdi.NewCache(cdi.WithSpecDirs(specDirs...), cdi.WithAutoRefresh(false)) // never fails
	if len(devices) == 0 {
		devices = specGPUs(cache, *resource)
		if len(devices) == 0 {
			fmt.Fprintf(os.Stderr, "gpu-device-plugin: no --device given and no CDI spec in %v names a %s device by UUID (%s=GPU-...)\n",
				specDirs, *resource, *resource)
			return 2
		}
	}
	p := &gpuPlugin{
		resource: *resource, devices: devices, specDirs: specDirs, pluginDir: *pluginDir,
		socket: filepath.Join(*pluginDir, *socketName), interval: *interval, replicas: *replicas,
		health: map[string]string{}, changed: make(chan struct{}), reasons: map[string]string{}, cache: cache,
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := p.run(ctx); err != nil {
		log.Printf("gpu-device-plugin: %v", err)
		return 1
	}
	return 0
}

// specGPUs finds the GPUs in the CDI specs when no --device names them: each device of the resource's
// kind named by a GPU UUID (NVIDIA's specs, and realnode.cdi's, name each GPU by index and by UUID).
func specGPUs(cache *cdi.Cache, resource string) []gpuDevice {
	var found []gpuDevice
	for _, name := range cache.ListDevices() {
		vendor, class, dev, err := parser.ParseQualifiedName(name)
		if err == nil && vendor+"/"+class == resource && strings.HasPrefix(dev, "GPU-") {
			found = append(found, gpuDevice{id: dev, cdi: name})
		}
	}
	return found
}

// run serves and registers, then checks health and the kubelet's socket each interval: a kubelet that
// restarts removes every plugin socket and makes a new kubelet.sock, so the plugin serves and registers again.
func (p *gpuPlugin) run(ctx context.Context) error {
	p.checkHealth()
	kubeletSock := filepath.Join(p.pluginDir, "kubelet.sock")
	for {
		server, err := p.serve()
		if err != nil {
			return err
		}
		registeredWith, err := p.registerWhenReady(ctx, kubeletSock)
		if err != nil {
			server.Stop()
			return err
		}
		restart := false
		for !restart {
			select {
			case <-ctx.Done():
				server.Stop()
				os.Remove(p.socket)
				return nil
			case <-time.After(p.interval):
			}
			p.checkHealth()
			if _, err := os.Stat(p.socket); err != nil {
				log.Printf("gpu-device-plugin: socket %s is gone (kubelet restarted): serving again", p.socket)
				restart = true
			} else if fi, err := os.Stat(kubeletSock); err == nil && !os.SameFile(fi, registeredWith) {
				log.Printf("gpu-device-plugin: %s is new (kubelet restarted): registering again", kubeletSock)
				restart = true
			}
		}
		server.Stop()
	}
}

func (p *gpuPlugin) serve() (*grpc.Server, error) {
	if err := os.Remove(p.socket); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("removing the old socket %s: %w", p.socket, err)
	}
	lis, err := net.Listen("unix", p.socket)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", p.socket, err)
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go server.Serve(lis) //nolint:errcheck // ends when the server is stopped
	return server, nil
}

// registerWhenReady registers with the kubelet once its socket answers, and returns the socket it
// registered through so that a new one (a restarted kubelet) is noticed.
func (p *gpuPlugin) registerWhenReady(ctx context.Context, kubeletSock string) (os.FileInfo, error) {
	for {
		fi, statErr := os.Stat(kubeletSock)
		if statErr == nil {
			err := p.register(ctx, kubeletSock)
			if err == nil {
				log.Printf("gpu-device-plugin: registered %s with %d GPU(s) x %d replica(s) at %s", p.resource, len(p.devices), p.replicas, p.socket)
				return fi, nil
			}
			log.Printf("gpu-device-plugin: registering with %s: %v (retrying)", kubeletSock, err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("stopped before the kubelet at %s took the registration", kubeletSock)
		case <-time.After(p.interval):
		}
	}
}

func (p *gpuPlugin) register(ctx context.Context, kubeletSock string) error {
	conn, err := grpc.NewClient("unix://"+kubeletSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     filepath.Base(p.socket),
		ResourceName: p.resource,
		Options:      &pluginapi.DevicePluginOptions{},
	})
	return err
}

// checkHealth reads the CDI specs again and marks each GPU healthy when the specs name it and every device
// node they give it (its own and the spec's common ones) is a character device.
func (p *gpuPlugin) checkHealth() {
	specErr := p.cache.Refresh()
	next := map[string]string{}
	for _, dev := range p.devices {
		next[dev.id] = pluginapi.Healthy
		reason := deviceProblem(p.cache, dev.cdi, specErr)
		if reason != "" {
			next[dev.id] = pluginapi.Unhealthy
		}
		if reason != p.reasons[dev.id] {
			if reason != "" {
				log.Printf("gpu-device-plugin: %s (%s) is unhealthy: %s", dev.id, dev.cdi, reason)
			} else {
				log.Printf("gpu-device-plugin: %s (%s) is healthy", dev.id, dev.cdi)
			}
			p.reasons[dev.id] = reason
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for id, h := range next {
		if p.health[id] != h {
			p.health = next
			close(p.changed)
			p.changed = make(chan struct{})
			return
		}
	}
}

func deviceProblem(cache *cdi.Cache, name string, specErr error) string {
	dev := cache.GetDevice(name)
	if dev == nil {
		reason := fmt.Sprintf("no CDI spec in %v names %s", cache.GetSpecDirectories(), name)
		if specErr != nil {
			reason += fmt.Sprintf(" (spec errors: %v)", specErr)
		}
		return reason
	}
	nodes := append([]*cdispec.DeviceNode(nil), dev.ContainerEdits.DeviceNodes...)
	nodes = append(nodes, dev.GetSpec().ContainerEdits.DeviceNodes...)
	for _, n := range nodes {
		host := n.HostPath
		if host == "" {
			host = n.Path
		}
		fi, err := os.Stat(host)
		if err != nil {
			return fmt.Sprintf("device node %s: %v", host, err)
		}
		if fi.Mode()&os.ModeCharDevice == 0 {
			return fmt.Sprintf("%s is not a character device", host)
		}
	}
	return ""
}

func (p *gpuPlugin) snapshot() ([]*pluginapi.Device, chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	list := make([]*pluginapi.Device, 0, len(p.devices)*p.replicas)
	for _, dev := range p.devices {
		for i := 0; i < p.replicas; i++ {
			list = append(list, &pluginapi.Device{ID: p.replicaID(dev.id, i), Health: p.health[dev.id]})
		}
	}
	return list, p.changed
}

// replicaID is the kubelet's ID of a GPU's i-th replica: the UUID itself without time-slicing.
func (p *gpuPlugin) replicaID(uuid string, i int) string {
	if p.replicas == 1 {
		return uuid
	}
	return fmt.Sprintf("%s::%d", uuid, i)
}

func (p *gpuPlugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *gpuPlugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	for {
		list, changed := p.snapshot()
		if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: list}); err != nil {
			return err
		}
		select {
		case <-stream.Context().Done():
			return nil
		case <-changed:
		}
	}
}

// Allocate answers each container with the CDI names of its GPUs, which the runtime turns into the
// spec's edits, and NVIDIA_VISIBLE_DEVICES with their UUIDs, as NVIDIA's plugin does in CDI mode.
func (p *gpuPlugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	byID := map[string]gpuDevice{}
	for _, dev := range p.devices {
		byID[dev.id] = dev
	}
	resp := &pluginapi.AllocateResponse{}
	for _, creq := range req.ContainerRequests {
		// Replicas of one GPU are the GPU once: one CDI name and one UUID each.
		seen := map[string]bool{}
		var ids []string
		for _, id := range creq.DevicesIds {
			uuid, _, _ := strings.Cut(id, "::")
			if _, ok := byID[uuid]; !ok {
				return nil, fmt.Errorf("unknown device %q: this plugin has %v", id, p.ids())
			}
			if !seen[uuid] {
				seen[uuid] = true
				ids = append(ids, uuid)
			}
		}
		sort.Strings(ids)
		cresp := &pluginapi.ContainerAllocateResponse{}
		for _, id := range ids {
			cresp.CdiDevices = append(cresp.CdiDevices, &pluginapi.CDIDevice{Name: byID[id].cdi})
		}
		cresp.Envs = map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(ids, ",")}
		resp.ContainerResponses = append(resp.ContainerResponses, cresp)
	}
	return resp, nil
}

func (p *gpuPlugin) ids() []string {
	ids := make([]string, 0, len(p.devices)*p.replicas)
	for _, dev := range p.devices {
		for i := 0; i < p.replicas; i++ {
			ids = append(ids, p.replicaID(dev.id, i))
		}
	}
	return ids
}
